"""Model definitions, configuration and checkpoint loading."""
