"""The baselines every stream-path goal is measured against: the cheapest streaming proxy this
stack can be (views.py), bare (settings.py: no middleware, no database, under plain daphne) and
on the app's own stack (stack_settings.py: the app's settings and middleware, served by the
app's own daphne beside `/api/quotes/stream`)."""
