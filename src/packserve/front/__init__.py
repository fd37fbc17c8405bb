"""The front process: owns the port, supervises the worker that holds the models."""
