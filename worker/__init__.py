"""shardwise.worker"""
