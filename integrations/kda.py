"""``chunkmeta.integrations.kda``: the name users import FLA's KDA/GDN adapter by.

The adapter lives in ``chunkmeta.integrations.fla``; everything it exports is here too.
"""

from chunkmeta.integrations.fla import *  # noqa: F403
from chunkmeta.integrations.fla import __all__  # noqa: F401
