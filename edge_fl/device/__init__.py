"""Device agent: pure core (training, privatising, encoding) and its MQTT runtime."""
