"""I/O edge to brokers: URL parsing and the embedded broker launcher."""
