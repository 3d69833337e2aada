"""How a run asks: the wire formats of each backend (`wire`), the HTTP chat client (`client`), streamed
answers reassembled (`stream`) and the worker processes that read them (`stream_workers`)."""
