"""Aggregator: pure round/aggregation cores and the MQTT service around them."""
