//! The docs cannot lie: every `paceline` command in a shell block or a code span of the
//! README and of docs/ parses with the real command line (a renamed flag or subcommand
//! fails here),
//! every TOML block loads through the config loader, and every JSON block that shows a
//! job or an outcome record parses as one.

use std::path::{Path, PathBuf};

use clap::Parser as _;
use paceline_cli::cli::Cli;
use paceline_shared::config::Config;
use paceline_shared::job::Job;
use paceline_shared::outcome::OutcomeRecord;

/// The README and every page under docs/.
fn pages() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut pages = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .map(|dir| dir.filter_map(Result::ok).map(|entry| entry.path()).filter(|path| path.extension().is_some_and(|ext| ext == "md")).collect())
        .unwrap_or_default();
    docs.sort();
    pages.extend(docs);
    pages
}

/// A fenced block: its language, its text, and the line of the page it starts on.
struct Block {
    page: String,
    language: String,
    text: String,
    line: usize,
}

/// The code spans of the pages' prose that hold a `paceline` command (`` `paceline
/// status --json` ``), each as a block of its own (language `inline`).
fn inline_commands() -> Vec<Block> {
    let mut found = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let name = page.file_name().unwrap().to_string_lossy().into_owned();
        let mut in_fence = false;
        for (index, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("```") {
                in_fence = !in_fence;
                continue;
            }
            // Between backticks: every other piece of the line, from the second.
            for span in line.split('`').skip(1).step_by(2).filter(|span| !in_fence && span.starts_with("paceline ")) {
                found.push(Block { page: name.clone(), language: "inline".to_owned(), text: format!("{span}\n"), line: index });
            }
        }
    }
    found
}

fn blocks() -> Vec<Block> {
    let mut found = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let name = page.file_name().unwrap().to_string_lossy().into_owned();
        let mut open: Option<Block> = None;
        for (index, line) in text.lines().enumerate() {
            let fence = line.trim_start().strip_prefix("```");
            match (fence, open.take()) {
                (Some(language), None) => open = Some(Block { page: name.clone(), language: language.trim().to_owned(), text: String::new(), line: index + 1 }),
                (Some(_), Some(block)) => found.push(block),
                (None, Some(mut block)) => {
                    block.text.push_str(line);
                    block.text.push('\n');
                    open = Some(block);
                }
                (None, None) => {}
            }
        }
    }
    found
}

/// Splits a shell line into words: quotes group, `#` after a space starts a comment.
fn words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let (mut word, mut quote, mut in_word) = (String::new(), None, false);
    let mut previous = ' ';
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                in_word = true;
            }
            (None, '#') if previous.is_whitespace() => break,
            (None, c) if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            (None, c) => {
                word.push(c);
                in_word = true;
            }
        }
        previous = c;
    }
    if in_word {
        words.push(word);
    }
    words
}

/// The `paceline` invocations of a shell block's lines, as words after `paceline`: the
/// optional parts of a synopsis (`[--json]`) taken, the first of alternatives
/// (`2xx|4xx`), placeholders given a value of their kind.
fn invocations(block: &str) -> Vec<(usize, Vec<String>)> {
    let mut found = Vec::new();
    let joined = block.replace("\\\n", " ");
    for (index, line) in joined.lines().enumerate() {
        // What a command's output is redirected to is not the command's.
        let pipeline = line.split(" > ").next().unwrap_or_default();
        for command in pipeline.split(" | ").flat_map(|part| part.split(" && ")).flat_map(|part| part.split("; ")) {
            let mut words: Vec<String> = words(command.trim().trim_start_matches('(').trim_start_matches('$').trim());
            // `NAME=value paceline ...`: the environment, not the command.
            while words.first().is_some_and(|word| word.contains('=') && !word.starts_with('-')) {
                words.remove(0);
            }
            let args: Vec<String> = match words.first().map(String::as_str) {
                Some("paceline") => words[1..].to_vec(),
                Some("cargo") if words.iter().any(|word| word == "paceline-cli") && words.iter().any(|word| word == "--") => {
                    words.iter().skip_while(|word| *word != "--").skip(1).cloned().collect()
                }
                _ => continue,
            };
            let args: Vec<String> = args
                .iter()
                .map(|word| word.trim_matches(|c| c == '[' || c == ']' || c == ')').to_owned())
                .filter(|word| !word.is_empty() && word != "..." && word != "…")
                .map(|word| if word.starts_with('-') || !word.contains('|') { word } else { word.split('|').next().unwrap_or_default().to_owned() })
                .map(|word| match word.as_str() {
                    "N" => "10".to_owned(),
                    "ADDR" => "127.0.0.1:8080".to_owned(),
                    _ => word,
                })
                .collect();
            found.push((index, args));
        }
    }
    found
}

#[test]
fn every_paceline_command_in_the_docs_parses_with_the_real_command_line() {
    let mut checked = 0;
    let mut wrong = Vec::new();
    let shell = blocks().into_iter().filter(|block| matches!(block.language.as_str(), "sh" | "bash" | "console" | "shell"));
    for block in shell.chain(inline_commands()) {
        for (offset, args) in invocations(&block.text) {
            checked += 1;
            if let Err(e) = Cli::try_parse_from(std::iter::once("paceline".to_owned()).chain(args.iter().cloned())) {
                // Prose names a command, often without its values (`paceline dlq`, `--lanes`):
                // there only a flag or subcommand that does not exist is wrong.
                let renamed = matches!(e.kind(), clap::error::ErrorKind::UnknownArgument | clap::error::ErrorKind::InvalidSubcommand);
                if block.language == "inline" && !renamed {
                    continue;
                }
                let first = e.to_string().lines().next().unwrap_or_default().to_owned();
                wrong.push(format!("{}:{}: paceline {}: {first}", block.page, block.line + 1 + offset, args.join(" ")));
            }
        }
    }
    assert!(checked >= 30, "only {checked} commands found: is the block scanner broken?");
    assert!(wrong.is_empty(), "{} of {checked} commands in the docs do not parse:\n{}", wrong.len(), wrong.join("\n"));
}

/// A TOML block as a whole config: what it leaves out of a config's required parts
/// (`[api]`, and `[quota]` unless it has `[lanes]`) is added.
fn as_config(block: &str) -> String {
    let mut text = String::new();
    if !block.contains("[api]") {
        text.push_str("[api]\nbase_url = \"https://api.example.com\"\n");
    }
    if !block.contains("[quota]") && !block.contains("[lanes]") {
        text.push_str("[quota]\ntiers = [\"10/s\"]\n");
    }
    text.push_str(block);
    text
}

#[test]
fn every_toml_block_in_the_docs_loads_as_a_config() {
    let secret = |_: &str| Some("a-secret-long-enough-for-any-key-0123".to_owned());
    let mut checked = 0;
    let mut wrong = Vec::new();
    for block in blocks().iter().filter(|block| block.language == "toml") {
        checked += 1;
        if let Err(problem) = Config::parse(&as_config(&block.text), Path::new("."), &secret) {
            wrong.push(format!("{}:{}: {problem}", block.page, block.line));
        }
    }
    assert!(checked >= 4, "only {checked} TOML blocks found");
    assert!(wrong.is_empty(), "TOML in the docs that the config loader refuses:\n{}", wrong.join("\n"));
}

#[test]
fn every_job_and_outcome_record_shown_in_the_docs_parses_as_one() {
    let mut checked = 0;
    for block in blocks().iter().filter(|block| block.language == "json") {
        let at = format!("{}:{}", block.page, block.line);
        if block.text.contains("\"request\"") {
            checked += 1;
            if let Err(e) = Job::parse(&block.text) {
                panic!("{at}: the job shown does not parse: {e}");
            }
        } else if block.text.contains("\"job_id\"") && block.text.contains("\"outcome\"") {
            checked += 1;
            if let Err(e) = serde_json::from_str::<OutcomeRecord>(&block.text) {
                panic!("{at}: the outcome record shown does not parse: {e}");
            }
        } else if let Err(e) = serde_json::from_str::<serde_json::Value>(&block.text) {
            panic!("{at}: not JSON: {e}");
        }
    }
    assert!(checked >= 2, "only {checked} jobs and records found");
}

#[test]
fn the_command_scanner_takes_synopses_as_a_reader_would() {
    let block = "paceline results --config p.toml [--json] [--since 10m] [--status 2xx|4xx|5xx|dead]   # a comment\nFOO=1 paceline dlq list --limit N\nprintf 'x' | paceline enqueue -\ncargo run --release -p paceline-cli -- demo\n";
    let found: Vec<String> = invocations(block).into_iter().map(|(_, args)| args.join(" ")).collect();
    assert_eq!(found, vec!["results --config p.toml --json --since 10m --status 2xx", "dlq list --limit 10", "enqueue -", "demo"]);
}

/// The pictures of the guide: each `docs/pictures/NAME.toml` and the `NAME.svg` drawn
/// from it.
fn pictures() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/pictures");
    let mut sources: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "toml"))
        .collect();
    sources.sort();
    sources
}

/// `PACELINE_DRAW_PICTURES=1 cargo test -p paceline-e2e --test docs` draws them again
/// after their sources changed.
#[test]
fn every_picture_in_the_docs_is_what_its_source_draws_and_is_shown_on_a_page() {
    let redraw = std::env::var_os("PACELINE_DRAW_PICTURES").is_some();
    let pages: String = pages().iter().map(|page| std::fs::read_to_string(page).unwrap()).collect();
    let sources = pictures();
    assert!(sources.len() >= 3, "the data flow, the circuit and the hand-over");
    let mut wrong = Vec::new();
    for source in sources {
        let diagram = paceline_sim::diagram::Diagram::from_toml(&std::fs::read_to_string(&source).unwrap()).unwrap();
        let drawn = diagram.to_svg().unwrap_or_else(|e| panic!("{}: {e}", source.display()));
        let svg = source.with_extension("svg");
        if redraw {
            std::fs::write(&svg, &drawn).unwrap();
        }
        if std::fs::read_to_string(&svg).unwrap_or_default() != drawn {
            wrong.push(format!(
                "{} is not what {} draws: redraw it with PACELINE_DRAW_PICTURES=1 cargo test -p paceline-e2e --test docs",
                svg.display(),
                source.display()
            ));
        }
        let name = svg.file_name().unwrap().to_string_lossy().into_owned();
        if !pages.contains(&format!("pictures/{name})")) {
            wrong.push(format!("no page shows {name}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
