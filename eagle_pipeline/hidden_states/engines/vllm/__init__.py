"""The vLLM engine: the servers' command, the model they load, the requests of a shard run, and the connector's files."""
