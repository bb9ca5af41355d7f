"""Model parallelism: the world as data-parallel replicas x model-parallel groups (layout)."""
