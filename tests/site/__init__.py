"""The visitor's pages: personas, permalinks, feedback, bad input and error pages, health."""
