"""Fleet simulation: device profiles (pure) and the many-device runtime."""
