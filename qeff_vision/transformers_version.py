"""The transformers releases the export patches are written against.

The exporter replaces transformers' attention, cache and mask internals (see
:mod:`qeff_vision.export.decoder`), and those internals change between minor releases:
5.24 renamed ``past_key_values`` to ``cache`` in every attention layer. Exporting with an untested
release would fail deep inside a trace with hundreds of unrelated-looking errors, so the export
path checks the installed version against the range the package declares and stops in one line.
"""

from importlib import metadata

from qeff_vision.errors import UserError

DISTRIBUTION = "qeff-vision"


def declared_range() -> str | None:
    """The ``transformers`` version range in the installed package's requirements, if installed."""
    try:
        requirements = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return None
    from packaging.requirements import Requirement

    for line in requirements:
        requirement = Requirement(line)
        if requirement.name == "transformers" and requirement.marker is None:
            return str(requirement.specifier)
    return None


def installed_version() -> str:
    """The installed transformers distribution's version."""
    return metadata.version("transformers")


def require_supported_transformers(installed: str | None = None, supported: str | None = None) -> None:
    """Raise one-line :class:`UserError` unless ``installed`` transformers is in the declared range.

    Args:
        installed: The version to check (default: :func:`installed_version`).
        supported: The allowed range (default: what the installed package declares; no check
            when the package metadata is absent, for example a bare source tree on ``PYTHONPATH``).
    """
    from packaging.specifiers import SpecifierSet

    if installed is None:
        installed = installed_version()
    if supported is None:
        supported = declared_range()
    if not supported:
        return
    allowed = SpecifierSet(supported)
    if not allowed.contains(installed, prereleases=True):
        supported = str(allowed)
        raise UserError(
            f"transformers {installed} is not supported: the export patches are written against "
            f"transformers{supported}; install it with `pip install 'transformers{supported}'` "
            "(or `make install`, which uses constraints.txt)"
        )
