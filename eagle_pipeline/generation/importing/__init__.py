"""Answers generated elsewhere: the import backend (`importer`) and the reader of answer files it shares with the
command line's `reconstruct` (`response_lines`)."""
