"""The REST face: the API's app, its routers, who may call it, and the server that runs it."""
