"""What plexd asks of the operating system beyond networking: systemd (notify, watchdog, scopes)."""
