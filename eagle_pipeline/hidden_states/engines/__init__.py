"""The extraction engines behind one interface (in process, torchrun, vLLM): each turns a shard job's rows into states."""
