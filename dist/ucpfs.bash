# bash completion for ucpfs(1). Installed as
# /usr/local/share/bash-completion/completions/ucpfs (`cmake --install build`); or `source` it.
#
# Subcommands and their options are read from `ucpfs --help` and `ucpfs SUB --help` of the ucpfs
# being completed, so the completion cannot fall behind the program. Values: directories for
# SRC/MNT/DST and --index-dir, files for --log/--rules/--pattern-rules/--svg, live ucpfs mounts
# for umount/sync/status, the presets for --preset, and common layouts for --layout.

# Prints the subcommands of `ucpfs --help` ("Subcommands:" section, first word of each line).
_ucpfs_subcommands() {
  "$1" --help 2>/dev/null | sed -n '/^Subcommands:/,$p' | sed -n 's/^  \([a-z][a-z-]*\) .*/\1/p'
}

# Prints the options of `ucpfs SUB --help`, each once: "-f", "--foreground", ...
_ucpfs_options() {
  "$1" "$2" --help 2>/dev/null | sed -n 's/^  \(-[^ ]*\).*/\1/p' | tr ',' '\n' | sed 's/{.*//' | grep -E '^--?[A-Za-z]' | sort -u
}

# True when option $3 of subcommand $2 takes a value (its help line names a type: TEXT, UINT, ...).
_ucpfs_takes_value() {
  "$1" "$2" --help 2>/dev/null | grep -E -e "^  ([^ ]*,)?$3( |,)" | grep -qE -e "$3 +(TEXT|UINT|INT|FLOAT|NUMBER|PATH|FILE)"
}

# Mount points of live ucpfs mounts (fuse.ucpfs in /proc/mounts; \040 is a space).
_ucpfs_mounts() {
  awk '$3 == "fuse.ucpfs" { gsub(/\\040/, " ", $2); print $2 }' /proc/mounts 2>/dev/null
}

_ucpfs() {
  local cur prev
  cur=${COMP_WORDS[COMP_CWORD]}
  prev=${COMP_WORDS[COMP_CWORD-1]}
  local prog=${COMP_WORDS[0]}
  local sub="" i
  for ((i = 1; i < COMP_CWORD; i++)); do
    case ${COMP_WORDS[i]} in
      -*) ;;
      *) sub=${COMP_WORDS[i]}; break ;;
    esac
  done
  if [[ -z $sub ]]; then
    COMPREPLY=($(compgen -W "$(_ucpfs_subcommands "$prog") --help --version" -- "$cur"))
    return
  fi
  # The value of an option.
  if [[ $prev == -* ]] && _ucpfs_takes_value "$prog" "$sub" "$prev"; then
    case $prev in
      --index-dir) COMPREPLY=($(compgen -d -- "$cur")) ;;
      --preset) COMPREPLY=($(compgen -W "auto torchtitan megatron hf" -- "$cur")) ;;
      --view) COMPREPLY=($(compgen -W "atomic safetensors hf universal target" -- "$cur")) ;;
      --layout)
        COMPREPLY=($(compgen -W "tp1_pp1_dp1 tp2_pp1_dp1 tp1_pp2_dp1 tp2_pp2_dp1 tp2_pp2_dp2 tp4_pp1_dp1 tp2_pp2_dp4 tp8_pp1_dp1" -- "$cur"))
        ;;
      *) COMPREPLY=($(compgen -f -- "$cur")) ;;
    esac
    return
  fi
  if [[ $cur == -* ]]; then
    COMPREPLY=($(compgen -W "$(_ucpfs_options "$prog" "$sub")" -- "$cur"))
    return
  fi
  case $sub in
    umount | sync | status) COMPREPLY=($(compgen -W "$(_ucpfs_mounts)" -- "$cur")) ;;
    inspect) COMPREPLY=($(compgen -f -- "$cur")) ;;
    *) COMPREPLY=($(compgen -d -- "$cur")) ;;
  esac
}

complete -o filenames -F _ucpfs ucpfs
