"""Moving one request's KV through a connector: send, receive, prefetch (with its CUDA staging),
the request objects KV is applied to, and the result logs."""
