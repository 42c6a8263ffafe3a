#!/usr/bin/env bash
# Validates every Kubernetes manifest under deploy/kubernetes (scripts/test.sh runs this): each
# kustomization is rendered as `kubectl apply -k` would (its resources, labels, images and JSON
# 6902 patches; any other kustomize feature fails here rather than being ignored) into
# target/manifests/, and every rendered object is checked with kubernetes-validate (PyPI, in a
# virtualenv under target/) in strict mode against each Kubernetes version below.
# That the flags, environment variables, ports and probe paths the manifests use exist in the
# binary is tests/deploy.rs's part.
set -euo pipefail
cd "$(dirname "$0")/.."

fail() {
  echo "validate-manifests.sh: FAILED: $*" >&2
  exit 1
}

KUBERNETES_VERSIONS=(1.33.0 1.35.0 1.37.0)
VENV=target/kube-validate-venv
if [ ! -x "$VENV/bin/kubernetes-validate" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV" || fail "cannot make a virtualenv (python3-venv)"
  "$VENV/bin/pip" install --quiet 'kubernetes-validate==1.37.0' \
    || fail "pip install kubernetes-validate failed"
fi

OUT=target/manifests
rm -rf "$OUT"
mkdir -p "$OUT"
kustomizations=()
while IFS= read -r file; do kustomizations+=("$(dirname "$file")"); done \
  < <(find deploy/kubernetes -name kustomization.yaml | sort)
[ ${#kustomizations[@]} -ge 2 ] || fail "expected the base and the redis-fleet overlay, found: ${kustomizations[*]}"

"$VENV/bin/python" - "$OUT" "${kustomizations[@]}" <<'EOF' || fail "rendering a kustomization failed"
import copy, os, sys
import yaml

KNOWN = {"apiVersion", "kind", "resources", "labels", "images", "patches"}

def load_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]

def pointer(path):
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]

def apply_op(doc, op, where):
    *parents, last = pointer(op["path"])
    node = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    kind = op["op"]
    if kind not in ("add", "replace", "remove"):
        sys.exit(f"{where}: unsupported op {kind}")
    if isinstance(node, list):
        if kind == "add":
            node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
        elif kind == "replace":
            node[int(last)] = copy.deepcopy(op["value"])
        else:
            del node[int(last)]
    else:
        if kind == "replace" and last not in node:
            sys.exit(f"{where}: replace of missing {op['path']}")
        if kind == "remove":
            del node[last]
        else:
            node[last] = copy.deepcopy(op["value"])

def matches(doc, target):
    api = doc.get("apiVersion", "")
    group, _, version = api.rpartition("/")
    checks = {
        "kind": doc.get("kind"),
        "name": doc.get("metadata", {}).get("name"),
        "group": group,
        "version": version,
    }
    return all(checks[k] == v for k, v in target.items())

def render(directory):
    kustomization = yaml.safe_load(open(os.path.join(directory, "kustomization.yaml")))
    unknown = set(kustomization) - KNOWN
    if unknown:
        sys.exit(f"{directory}: kustomization fields this check cannot render: {sorted(unknown)}")
    docs = []
    for resource in kustomization.get("resources", []):
        path = os.path.normpath(os.path.join(directory, resource))
        docs += render(path) if os.path.isdir(path) else load_docs(path)
    for label in kustomization.get("labels", []):
        if label.get("includeSelectors") or label.get("includeTemplates"):
            sys.exit(f"{directory}: labels with selectors or templates are not rendered here")
        for doc in docs:
            doc.setdefault("metadata", {}).setdefault("labels", {}).update(label["pairs"])
    for image in kustomization.get("images", []):
        for doc in docs:
            pod = doc.get("spec", {}).get("template", {}).get("spec", {})
            for container in pod.get("containers", []) + pod.get("initContainers", []):
                name = container["image"].split(":")[0]
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image.get('newTag', 'latest')}"
    for patch in kustomization.get("patches", []):
        where = os.path.join(directory, patch["path"])
        ops = load_docs(where)[0]
        hit = [d for d in docs if matches(d, patch["target"])]
        if len(hit) != 1:
            sys.exit(f"{where}: its target {patch['target']} matches {len(hit)} objects, not 1")
        for op in ops:
            apply_op(hit[0], op, where)
    return docs

out = sys.argv[1]
for directory in sys.argv[2:]:
    docs = render(directory)
    name = os.path.relpath(directory, "deploy").replace("/", "-")
    for n, doc in enumerate(docs):
        kind = doc["kind"].lower()
        with open(os.path.join(out, f"{name}--{n:02}-{kind}-{doc['metadata']['name']}.yaml"), "w") as f:
            yaml.safe_dump(doc, f, sort_keys=False)
    print(f"validate-manifests.sh: {directory}: {len(docs)} objects rendered", file=sys.stderr)
EOF

for version in "${KUBERNETES_VERSIONS[@]}"; do
  "$VENV/bin/kubernetes-validate" --strict --quiet -k "$version" "$OUT"/*.yaml \
    || fail "kubernetes-validate --strict -k $version refused a manifest (rendered in $OUT)"
done
echo "validate-manifests.sh: $(ls "$OUT" | wc -l) objects from ${#kustomizations[@]} kustomizations valid (strict) against Kubernetes ${KUBERNETES_VERSIONS[*]}" >&2
