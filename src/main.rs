fn main() -> std::process::ExitCode {
    agents::cli::main()
}
