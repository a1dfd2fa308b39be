from llama_ane.cli import main

main()
