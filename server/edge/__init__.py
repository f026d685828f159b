"""The HTTP edge: the app (`app`) and the context every route takes (`context`), the
middleware (`middleware`: API key, body limits, metrics; `disconnect`; `tracing`), the
HTTP/1.1 details uvicorn leaves open (`http11`: head limits and timeouts), the error shapes
(`errors`) and the routes, one module per concern (`routes/`)."""
