"""Pages of the documentation site generated from the code (registries, spec schema), at build time.

``hooks.py`` is the mkdocs hook (``mkdocs.yml``: ``hooks:``) that adds them to the site, so nothing
generated is committed; the README's family table is the one generated text in the repository, and
``tests/test_docs_site.py`` fails when it differs from :func:`families.readme_table`.
"""
