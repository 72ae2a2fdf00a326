"""shardwise.crds"""
