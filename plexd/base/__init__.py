"""Small parts every layer uses and that use nothing of plexd's: crash-safe files, bounded JSON, Go's wire formats,
clocks, backoff, errors, logging.
"""
