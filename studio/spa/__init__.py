"""Serves the built studio frontend (`frontend/dist`): the single-page app at every
page path, and its hashed bundles under `/assets/`."""
