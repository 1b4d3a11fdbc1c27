"""One module per ``attnzoo`` sub-command (discovered by attnzoo.cli)."""
