"""The HTTP edge: app factories, server and workers, middleware, admission, CORS, data-plane handlers, OpenAPI."""
