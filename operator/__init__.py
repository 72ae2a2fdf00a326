"""shardwise.operator"""
