"""Use-cases behind the routes."""
