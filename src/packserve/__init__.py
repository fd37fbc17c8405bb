"""packserve: one inference process, many models, a memory scheduler operators control."""

__version__ = "0.1.0"
