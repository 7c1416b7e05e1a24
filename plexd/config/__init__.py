"""The configuration file: its schema, defaults and checks (`settings`), and in-place edits (`edit`).
"""
