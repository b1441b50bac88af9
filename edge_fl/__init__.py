"""edge-fl: private, bandwidth-frugal asynchronous federated learning over MQTT."""

__version__ = "0.1.0"
