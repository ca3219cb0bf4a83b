"""The rules and facts every other package stands on: errors, dtypes, what a task reads, how a
config.json value is read and named. Nothing here imports kvbench above it."""
