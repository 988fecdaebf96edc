"""The generation log's writer and outbox, and the app's own logging."""
