from gradseam.tools.cli import main

main()
