#!/bin/sh
# render-acl.sh TEMPLATE OUT: the ACL file Redis loads, from deploy/users.acl (events/acl.py renders that).
# Each #${VAR} becomes the SHA-256 of the password in $VAR, or in the file named by $VAR_FILE (a secret).
# The role passwords are required: without one, nothing is written and Redis does not start. A user
# whose optional password (ADMIN, REPLICATION, SENTINEL, GATEWAY) is not given stays off, with no password.
set -eu
required="CONTROLLER_PASSWORD EXECUTOR_PASSWORD TRAINER_PASSWORD STATUS_PASSWORD"
template=$1
out=$2
tmp="$out.tmp"
: > "$tmp"
while IFS= read -r line; do
  var=$(printf '%s\n' "$line" | sed -n 's/.*#\${\([A-Z0-9_]*\)}.*/\1/p')
  if [ -n "$var" ]; then
    eval "value=\${$var:-}"
    eval "file=\${${var}_FILE:-}"
    if [ -z "$value" ] && [ -n "$file" ]; then
      value=$(cat "$file")
    fi
    if [ -z "$value" ]; then
      case " $required " in
        *" $var "*) echo "render-acl: set $var (or ${var}_FILE): the role has no password" >&2; rm -f "$tmp"; exit 1 ;;
      esac
      line=$(printf '%s\n' "$line" | sed "s/ on #\${$var}/ off resetpass/")
    else
      sha=$(printf '%s' "$value" | sha256sum | cut -d' ' -f1)
      line=$(printf '%s\n' "$line" | sed "s/#\${$var}/#$sha/")
    fi
  fi
  printf '%s\n' "$line" >> "$tmp"
done < "$template"
chmod 600 "$tmp"
mv "$tmp" "$out"
