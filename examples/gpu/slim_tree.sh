#!/usr/bin/env bash
# The device tool sends the whole working tree with every call, in 64 MiB at most together with what a call carries.
# Four tracked files make 49 MB of the tree's 51: the regenerated token ids (not needed on the device), and the shipped
# drafter's weights and datastore (needed once). `slim_tree.sh untrack` takes them out of git's index and ignores them
# for the calls, so they travel only where a call carries them; `slim_tree.sh restore` puts them back. Nothing is
# committed in between: run `restore` right after the device calls, before any commit.
set -euo pipefail
cd "$(dirname "$0")/../.."
FILES=(
  data/smollm2-regen/ids.safetensors
  data/smollm2-regen/heldout_ids.safetensors
  src/hf_domino/checkpoints/smollm2-135m-instruct-domino/model.safetensors
  src/hf_domino/checkpoints/smollm2-135m-instruct-domino/draft_datastore.safetensors
)
EXCLUDE=.git/info/exclude
MARK="# slim_tree.sh: travels only when carried"
case ${1:-} in
  untrack)
    git rm -q --cached -- "${FILES[@]}"
    { echo "$MARK"; printf '/%s\n' "${FILES[@]}"; } >> $EXCLUDE
    ;;
  restore)
    git reset -q -- "${FILES[@]}"
    grep -v -x -F -f <(echo "$MARK"; printf '/%s\n' "${FILES[@]}") $EXCLUDE > $EXCLUDE.tmp || true
    mv $EXCLUDE.tmp $EXCLUDE
    ;;
  *) echo "usage: $0 untrack|restore" >&2; exit 2 ;;
esac
echo "working tree that travels: $(git ls-files -coz --exclude-standard | du -cb --files0-from=- | tail -1 | cut -f1) bytes"
