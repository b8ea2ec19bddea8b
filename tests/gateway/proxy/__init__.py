"""gateway.proxy: the OpenAI-compatible proxy (and the Responses and Messages dialects) in front of
real and scripted upstreams."""
