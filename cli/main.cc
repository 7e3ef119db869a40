// The `ucpfs` command. Subcommands call the same core/index APIs the filesystem uses.
#include <CLI/CLI.hpp>
#include <iostream>
#include <string>

#include "cli/inspect.h"

int main(int argc, char** argv) {
  CLI::App app{
      "ucpfs: mount a distributed training checkpoint as resharded views.\n"
      "This version inspects torch.save files; mounting arrives with the DCP slice."};
  app.set_version_flag("--version", std::string("ucpfs ") + UCPFS_VERSION);
  app.require_subcommand(0, 1);

  std::string inspect_path;
  bool inspect_json = false;
  CLI::App* inspect = app.add_subcommand(
      "inspect", "Show the tensors of a torch.save file: key, dtype, shape, stride, byte offsets");
  inspect->add_option("FILE", inspect_path, "a torch.save file (.pt)")->required();
  inspect->add_flag("--json", inspect_json, "print one JSON object instead of a table");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (inspect->parsed()) return ucpfs::cli::RunInspect(inspect_path, inspect_json, std::cout, std::cerr);
  std::cerr << app.help() << "ucpfs: a subcommand is required\n";
  return 2;
}
