"""One router per resource (FastAPI's "bigger applications" layout); ``app.create_app`` includes them."""
