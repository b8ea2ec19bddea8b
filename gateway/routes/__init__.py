"""HTTP routers of the gateway: thin, they parse, call the serving objects, answer."""
