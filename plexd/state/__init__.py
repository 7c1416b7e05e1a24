"""The model plexd converges to: the wire documents (`model`), the desired state built from them (`desired`, with the
policy and the route limits it applies) and its journaled store (`desired_store`).
"""
