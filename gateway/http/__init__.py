"""What both HTTP planes share: the state behind an AppKey, request ids and the error
shapes, security headers, admission and the drain, CORS, and reading request bodies."""
