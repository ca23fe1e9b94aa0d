"""Hostile input to every surface: named errors or recorded rejects, never a traceback, a hang or a silent success."""
