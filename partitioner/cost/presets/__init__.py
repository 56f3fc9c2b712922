"""Built-in cluster presets (YAML); load them with ``Cluster.preset(name)``."""
