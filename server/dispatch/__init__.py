"""Delivering one request: a worker picked through routing, the request forwarded, retried
elsewhere when the worker fails before answering (`dispatcher`), a stream under way moved to
another worker from the token it reached (`migration`), each decision noted on the request's
span (`spans`)."""
