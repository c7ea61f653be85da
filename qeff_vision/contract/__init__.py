"""The language/vision contract as pure data: IO tables and symbols. Imports nothing of ours but symbols."""
