"""shardwise: run large language models sharded across GPU nodes on Kubernetes."""

__version__ = "0.1.0"
