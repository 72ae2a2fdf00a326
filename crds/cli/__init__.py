"""Commands of the API: `shardwise crds generate|check` (crds) and `shardwise inspect` (inspect).

May import: shardwise.crds
"""
