"""shardwise.e2e"""
