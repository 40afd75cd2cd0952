"""The Textual live monitor and steering console (see the TUI issue); nothing here yet."""
