"""Request bodies in the OpenAPI document for routes that read their body themselves.

The Messages routes parse their body in an intake thread (gateway/intake), so FastAPI
sees no body parameter and would document none. ``request_body`` gives the route's
``openapi_extra``; ``install`` puts the models' shared definitions where the
references point (``components.schemas``), so the document stays valid for clients
and for the schemathesis test.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"
_DEFS: dict[str, Any] = {}  # definitions the documented bodies refer to


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting ``model`` as the required JSON body."""
    schema = model.model_json_schema(ref_template=_REF)
    _DEFS.update(schema.pop("$defs", {}))
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }
    }


def install(app: FastAPI) -> None:
    """Wrap ``app.openapi`` so the document carries the bodies' definitions."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = base()
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in _DEFS.items():
            schemas.setdefault(name, schema)
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
