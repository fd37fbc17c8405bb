"""Engines behind the `Backend` contract (packserve.core.backend), one module each."""

from __future__ import annotations

from packserve.core.backend import Backend, LoadSpec


def create_backend(spec: LoadSpec) -> Backend:
    """The server's backend factory: picks the engine named by `spec.backend`."""
    if spec.backend == "sentence-transformers":
        from packserve.backends.sentence_tf import SentenceTransformerBackend

        return SentenceTransformerBackend(spec)
    if spec.backend == "cross-encoder":
        from packserve.backends.sentence_tf import CrossEncoderBackend

        return CrossEncoderBackend(spec)
    if spec.backend == "llama-cpp":
        from packserve.backends.llama import LlamaCppBackend

        return LlamaCppBackend(spec)
    if spec.backend == "fake":
        from packserve.backends.fake import FakeBackend

        return FakeBackend(spec)
    raise ValueError(f"unknown backend {spec.backend!r}")


def prepare(backends: set[str]) -> None:
    """Import engine libraries once at start, so their import cost is not counted in the
    first model's measured footprint nor paid by its first request."""
    if backends & {"sentence-transformers", "cross-encoder"}:
        import sentence_transformers  # noqa: F401
    if "llama-cpp" in backends:
        import llama_cpp  # noqa: F401
