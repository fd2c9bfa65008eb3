from gradseam.cli import main

main()
