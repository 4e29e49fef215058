#!/usr/bin/env python3
"""kubeconform schemas, offline, in its `{{ .ResourceKind }}{{ .KindSuffix }}.json`
layout (deployment-apps-v1.json, session-agents-exe-v1alpha1.json), strict
(additionalProperties: false wherever properties are listed, as kubeconform's
own `-strict` schema sets are).

  kubeconform-schemas.py OUT_DIR SWAGGER_JSON [CRD_YAML ...]

SWAGGER_JSON: Kubernetes' api/openapi-spec/swagger.json (in the k8s.io/kubernetes
Go module the test cluster is built from). Built-in kinds point into one
_definitions.json with relative $refs. CRD_YAML: the project's CRDs, one
schema per served version.
"""
import json
import os
import sys

import yaml

INT_OR_STRING = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
QUANTITY = {"oneOf": [{"type": "string"}, {"type": "number"}]}


def kind_suffix(group, version):
    """kubeconform's KindSuffix: -<first label of the group>-<version>, or -<version>."""
    return f"-{group.split('.')[0].lower()}-{version}" if group else f"-{version}"


def strict(node, ref_prefix):
    """Walks a schema: closes objects, rewrites $refs, maps Kubernetes' extensions."""
    if isinstance(node, list):
        return [strict(n, ref_prefix) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("format") == "int-or-string" or node.get("x-kubernetes-int-or-string"):
        return dict(INT_OR_STRING, description=node.get("description", ""))
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#/definitions/"):
            out[key] = ref_prefix + value
        elif key in ("properties", "patternProperties", "definitions"):
            out[key] = {k: strict(v, ref_prefix) for k, v in value.items()}
        else:
            out[key] = strict(value, ref_prefix)
    open_object = node.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in node
    if "properties" in out and not open_object:
        out["additionalProperties"] = False
    if node.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out


def write(out_dir, name, schema):
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(schema, f)


def builtins(out_dir, swagger_path):
    definitions = json.load(open(swagger_path))["definitions"]
    definitions["io.k8s.apimachinery.pkg.api.resource.Quantity"] = QUANTITY
    shared = {"definitions": {k: strict(v, "") for k, v in definitions.items()}}
    write(out_dir, "_definitions.json", shared)
    count = 0
    for name, definition in definitions.items():
        for gvk in definition.get("x-kubernetes-group-version-kind", []):
            schema = strict(definition, "_definitions.json")
            file = gvk["kind"].lower() + kind_suffix(gvk["group"], gvk["version"]) + ".json"
            write(out_dir, file, schema)
            count += 1
    return count


def crds(out_dir, path):
    count = 0
    for crd in yaml.safe_load_all(open(path)):
        if not crd or crd.get("kind") != "CustomResourceDefinition":
            continue
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = strict(version["schema"]["openAPIV3Schema"], "")
            props = schema.setdefault("properties", {})
            props.setdefault("apiVersion", {"type": "string"})
            props.setdefault("kind", {"type": "string"})
            props.setdefault("metadata", {"type": "object"})
            file = kind.lower() + kind_suffix(group, version["name"]) + ".json"
            write(out_dir, file, schema)
            count += 1
    return count


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    out_dir, swagger = argv[1], argv[2]
    os.makedirs(out_dir, exist_ok=True)
    n = builtins(out_dir, swagger)
    m = sum(crds(out_dir, p) for p in argv[3:])
    print(f"kubeconform-schemas: {n} built-in and {m} CRD schemas in {out_dir}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv)
